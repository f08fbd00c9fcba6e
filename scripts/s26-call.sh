# One device call of the twenty-sixth session: $STEPS of scripts/s26-device.sh, logs packed.
bash scripts/s26-device.sh ${STEPS-abnext} 2>&1 | tee $OUT/console.txt
cd $OUT && tar cJf logs.tar.xz $(ls | grep -v console.txt) && ls
