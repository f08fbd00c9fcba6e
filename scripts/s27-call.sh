# One device call of the twenty-seventh session: $STEPS of scripts/s27-device.sh, logs packed.
bash scripts/s27-device.sh ${STEPS-abuq} 2>&1 | tee $OUT/console.txt
cd $OUT && tar cJf logs.tar.xz $(ls | grep -v console.txt) && ls
