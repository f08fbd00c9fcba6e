# One device call of the twenty-fourth session: $STEPS of scripts/s24-device.sh, logs packed.
bash scripts/s24-device.sh ${STEPS:-check absums} 2>&1 | tee $OUT/console.txt
cd $OUT && tar cJf logs.tar.xz $(ls | grep -v console.txt) && ls
