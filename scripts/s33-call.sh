# One device call of the thirty-third session: $STEPS of scripts/s33-device.sh, logs packed.
bash scripts/s33-device.sh ${STEPS-bwcheck} 2>&1 | tee $OUT/console.txt
cd $OUT && tar cJf logs.tar.xz $(ls | grep -v console.txt) && ls
