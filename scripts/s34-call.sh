# One device call of the thirty-fourth session: $STEPS of scripts/s34-device.sh, logs packed.
bash scripts/s34-device.sh ${STEPS-chain} 2>&1 | tee $OUT/console.txt
cd $OUT && tar cJf logs.tar.xz $(ls | grep -v console.txt) && ls
