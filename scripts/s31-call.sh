# One device call of the thirty-first session: $STEPS of scripts/s31-device.sh, logs packed.
bash scripts/s31-device.sh ${STEPS-bw} 2>&1 | tee $OUT/console.txt
cd $OUT && tar cJf logs.tar.xz $(ls | grep -v console.txt) && ls
