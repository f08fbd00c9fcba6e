# One device call of the thirtieth session: $STEPS of scripts/s30-device.sh, logs packed.
bash scripts/s30-device.sh ${STEPS-pfr} 2>&1 | tee $OUT/console.txt
cd $OUT && tar cJf logs.tar.xz $(ls | grep -v console.txt) && ls
