#!/usr/bin/env bash
# Byte identity of a refactor: the residual digests and greedy tokens of one source tree, per
# MMQ variant, under the wave-1 routing (fp32), written to OUT_DIR as LABEL-<variant>.json and
# LABEL-<variant>-greedy.txt. Run it on the tree before and after a change, then compare:
#   bash bench/identity_digests.sh OLD_TREE old OUT_DIR f16_gemm f16_fused f16_pipe
#   bash bench/identity_digests.sh .        new OUT_DIR f16_gemm f16_fused f16_pipe
#   python bench/residual_digests.py --compare OUT_DIR/old-f16_gemm.json OUT_DIR/new-f16_gemm.json
set -u
tree=$1; label=$2; out=$(cd "$3" && pwd); shift 3
cd "$tree"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
for v in "$@"; do
  t0=$SECONDS
  STRATA_ROUTING=fp32 STRATA_MMQ_KERNEL=$v python3 bench/residual_digests.py \
    --out "$out/$label-$v.json" --shapes small,30b --prompts 128,1024,4096,9200 \
    > "$out/$label-$v.log" 2>&1
  echo "$label $v digests rc=$? $((SECONDS - t0)) s"
  for p in "The experts stream" "Hello there, a longer prompt for the model to continue with some tokens"; do
    STRATA_ROUTING=fp32 STRATA_MMQ_KERNEL=$v python3 -m strata_rt.cli generate \
      configs/tiny-qwen3moe.yaml --prompt "$p" -n 24 --ids --backend cuda 2>/dev/null \
      | sed -n 1p >> "$out/$label-$v-greedy.txt"
  done
done
