# One device call of the twenty-eighth session: $STEPS of scripts/s28-device.sh, logs packed.
bash scripts/s28-device.sh ${STEPS-abcl} 2>&1 | tee $OUT/console.txt
cd $OUT && tar cJf logs.tar.xz $(ls | grep -v console.txt) && ls
