# One device call of the thirty-seventh session: $STEPS of scripts/s37-device.sh (plus
# $ON_H200's, first, when the card is an H200), logs packed.
steps=${STEPS-bench}
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in *H200*) steps="${ON_H200:-} $steps" ;; esac
bash scripts/s37-device.sh $steps 2>&1 | tee $OUT/console.txt
cd $OUT && tar cJf logs.tar.xz $(ls | grep -v console.txt) && ls
