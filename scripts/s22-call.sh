# One device call of the twenty-second session: $STEPS of scripts/s22-device.sh, logs packed.
bash scripts/s22-device.sh ${STEPS:-check abbin} 2>&1 | tee $OUT/console.txt
cd $OUT && tar cJf logs.tar.xz $(ls | grep -v console.txt) && ls
