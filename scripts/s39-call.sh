# One device call of the thirty-ninth session: $STEPS of scripts/s39-device.sh (on an H200:
# $ON_H200's first, then $STEPS; with H200_ONLY=1 only $ON_H200's), logs packed.
steps=${STEPS-bench}
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
*H200*) if [ -n "${H200_ONLY:-}" ]; then steps="${ON_H200:-}"; else steps="${ON_H200:-} $steps"; fi ;;
esac
bash scripts/s39-device.sh $steps 2>&1 | tee $OUT/console.txt
cd $OUT && tar cJf logs.tar.xz $(ls | grep -v console.txt) && ls
