# One device call of the twenty-third session: $STEPS of scripts/s23-device.sh, logs packed.
bash scripts/s23-device.sh ${STEPS:-boundary} 2>&1 | tee $OUT/console.txt
cd $OUT && tar cJf logs.tar.xz $(ls | grep -v console.txt) && ls
