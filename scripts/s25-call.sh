# One device call of the twenty-fifth session: $STEPS of scripts/s25-device.sh, logs packed.
bash scripts/s25-device.sh ${STEPS:-trsums} 2>&1 | tee $OUT/console.txt
cd $OUT && tar cJf logs.tar.xz $(ls | grep -v console.txt) && ls
