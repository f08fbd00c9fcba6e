# One device call of the twenty-ninth session: $STEPS of scripts/s29-device.sh, logs packed.
bash scripts/s29-device.sh ${STEPS-h200} 2>&1 | tee $OUT/console.txt
cd $OUT && tar cJf logs.tar.xz $(ls | grep -v console.txt) && ls
