#!/usr/bin/env bash
# One GPU session in one command: every GPU test, then the benchmarks. Logs, JSON and tables go
# under $BENCH_OUT (default ./out). Stages run in order; pick them with arguments:
#   bash bench/gpu_suite.sh tests digests gemm routing formats ggml mmq prefill-quick prefill \
#        stream-235b attention dense whole-30b whole-235b whole-235b-16g acceptance decode \
#        peers ncu-gemm decode-ab stream-ab decode-ncu short-timing chains-ab short-ncu pass-ab pass-ring
#        attention-ab (ncu-gemm, decode-ncu:
#        Nsight Compute, $NCU or ncu on PATH; decode-ncu: each kernel of a gemv decode step,
#        bench/ncu_table.py's table; short-timing: STRATA_PREFILL_TIMING's phase table of a
#        254-token prompt, all resident and a quarter;
#        decode-ab: the decode GPU tests, then bench_decode with the defaults and with the
#        decode switches' other settings one by one, LLAMA_BENCH=PATH adds llama.cpp to its
#        first run; stream-ab: the routed walk's GPU tests and switched copies, then short
#        prompts under each prefill_stream setting on one engine; chains-ab: the routed walk's
#        GPU tests, then short prompts on one and four copy streams; short-ncu: Nsight Compute
#        sections of the table products of a 254-token prefill, every expert resident;
#        pass-ab: the layer pass's GPU tests, then long prompts under prefill_order chunks and
#        layers, the 30B shape a quarter resident and the 235B shape under 16 GiB; pass-ring:
#        the 235B pass again with a 2 GiB ring; attention-ab: the wgmma attend's probe and GPU
#        tests, both attend kernels alone, then long prompts of the 30B shape under each)
# A failing stage is reported and the next one still runs; the exit code counts failures.
set -uo pipefail
out=${BENCH_OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
failures=0
summary=()

stage() {  # name, command...
    local name=$1; shift
    local t0=$SECONDS
    echo "=== $name: $*"
    if "$@" > "$out/$name.log" 2>&1; then
        summary+=("$name: ok ($((SECONDS - t0)) s)")
    else
        failures=$((failures + 1))
        summary+=("$name: FAILED ($((SECONDS - t0)) s), see $name.log")
    fi
    tail -n 25 "$out/$name.log"
}

for what in "${@:-tests}"; do
    case $what in
        tests) stage gpu-tests python3 -m pytest -m gpu -q -ra -p no:cacheprovider \
                   --junitxml="$out/gpu-tests.xml" ;;
        digests) stage digests env STRATA_ROUTING=fp32 STRATA_MMQ_KERNEL=f16_pipe \
                   python3 bench/residual_digests.py --out "$out/digests.json" \
                   --compare-to bench/results/digests-before-6674ce9.json ;;
        gemm) stage bench-gemm python3 bench/bench_gemm.py --json "$out/gemm.json" ;;
        routing) stage bench-routing python3 bench/bench_routing.py --json "$out/routing.json" ;;
        formats) stage bench-formats python3 bench/bench_formats.py --json "$out/formats.json" ;;
        ggml) stage bench-ggml python3 bench/bench_ggml.py --json "$out/ggml.json" ;;
        mmq) stage bench-mmq python3 bench/bench_mmq.py --reps 7 --json "$out/mmq.json" ;;
        prefill-quick) stage bench-prefill-quick python3 bench/bench_prefill.py --layers 8 \
                   --prompts 1030,8179 --pairs 1 --out "$out" ;;
        prefill) stage bench-prefill python3 bench/bench_prefill.py --out "$out" ;;
        stream-235b) stage stream-235b env STRATA_HOST_MEMORY_CHECK=0 python3 -m strata_rt.cli \
                   run configs/qwen3-235b-a22b-stream.yaml --json "$out/stream-235b.json" ;;
        ncu-gemm) stage ncu-gemm "${NCU:-ncu}" -k regex:device_kernel --launch-skip 60 --launch-count 1 \
                   --section SpeedOfLight --section Occupancy --section ComputeWorkloadAnalysis \
                   --section LaunchStats python3 bench/bench_gemm.py --models 30b --tokens 8192 \
                   --reps 3 --tiles none --no-torch ;;
        attention) stage bench-attention python3 bench/bench_attention.py --json "$out/attention.json" ;;
        attention-ab) stage attention-probe python3 bench/probe_attention_sm90.py
                   stage attention-tests python3 -m pytest -m gpu -q -ra -p no:cacheprovider \
                       tests/test_attention_gpu.py
                   stage bench-attention python3 bench/bench_attention.py --json "$out/attention.json"
                   for k in mma wgmma; do
                       stage "attention-whole-$k" env STRATA_PREFILL_ATTENTION=$k python3 \
                           bench/bench_whole.py --prompts 8179,30118 --warmups 2 --reps 2 \
                           --out "$out/whole-attention-$k"
                   done ;;
        dense) stage bench-dense python3 bench/bench_dense.py --json "$out/dense.json" ;;
        whole-30b) stage whole-30b python3 bench/bench_whole.py --out "$out" ;;
        whole-235b) stage whole-235b env STRATA_HOST_MEMORY_CHECK=0 python3 bench/bench_whole.py \
                   --config configs/qwen3-235b-a22b-whole.yaml --prompts 254,8179,30118 \
                   --warmups 1 --reps 1 --out "$out" ;;
        whole-235b-16g) stage whole-235b-16g env STRATA_HOST_MEMORY_CHECK=0 python3 \
                   bench/bench_whole.py --config configs/qwen3-235b-a22b-whole-16g.yaml \
                   --prompts 254,8179,30118 --warmups 1 --reps 1 --out "$out" ;;
        acceptance) stage bench-acceptance python3 bench/bench_acceptance.py --out "$out" ;;
        decode) stage bench-decode python3 bench/bench_decode.py --out "$out" ;;
        peers) stage peer-tests python3 -m pytest -q -ra -p no:cacheprovider tests/test_peers.py ;;
        decode-ab) stage decode-ab-tests python3 -m pytest -m gpu -q -ra -p no:cacheprovider \
                   tests/test_sampling_gpu.py tests/test_gemv_dense_gpu.py tests/test_decode_gpu.py
                   # LLAMA_BENCH (a llama-bench binary): llama.cpp in the first run, same file
                   peer=(${LLAMA_BENCH:+--llama-bench "$LLAMA_BENCH" --llama-timeout 120})
                   for v in default STRATA_DECODE_ARGMAX=host STRATA_DECODE_DENSE=gemm \
                            "STRATA_DECODE_ARGMAX=host STRATA_DECODE_DENSE=gemm"; do
                       stage "decode-ab-${v// /+}" env ${v/default/} python3 bench/bench_decode.py \
                           --steps 32 --warmups 1 --paths gemv --regimes all,quarter \
                           "${peer[@]}" --json "$out/decode-ab-${v// /+}.json" --out "$out"
                       peer=()
                   done ;;
        stream-ab) stage stream-ab-tests python3 -m pytest -m gpu -q -ra -p no:cacheprovider \
                   tests/test_routed_walk.py tests/test_routed_prefill.py
                   stage switched-copies python3 bench/bench_switched_copies.py
                   stage stream-ab python3 bench/bench_whole.py --prompts 254,1030 \
                       --streams walk,routed,routed_walk --warmups 2 --reps 3 --out "$out" ;;
        decode-ncu) # each kernel of two all-resident gemv decode steps, at the run's own clocks
                   stage decode-ncu "${NCU:-ncu}" --profile-from-start off --cache-control none \
                       --clock-control none --metrics gpu__time_duration.sum --csv \
                       --log-file "$out/decode-ncu.csv" python3 bench/bench_decode.py --steps 2 \
                       --warmups 1 --paths gemv --regimes all --profile --out ''
                   stage decode-ncu-table python3 bench/ncu_table.py "$out/decode-ncu.csv" \
                       --per 2 --layers 48 ;;
        short-timing) # the phase table of a 254-token prompt, all resident and a quarter
                   sed 's/^expert_cache: .*/expert_cache: all/' configs/qwen3-30b-a3b-whole.yaml \
                       > "$out/all-resident.yaml"
                   for c in "$out/all-resident.yaml" configs/qwen3-30b-a3b-whole.yaml; do
                       stage "short-timing-$(basename "$c" .yaml)" env STRATA_PREFILL_TIMING=1 \
                           python3 -m strata_rt.cli run "$c" --prompts 254,254
                   done ;;
        chains-ab) # the routed walk on one and on four copy streams: its GPU tests, then
                   # short prompts a quarter resident (bench/notes.md W69)
                   stage chains-tests python3 -m pytest -m gpu -q -ra -p no:cacheprovider \
                       tests/test_copy_chains.py tests/test_routed_walk.py
                   for n in 1 4; do
                       stage "chains-$n" env STRATA_COPY_CHAINS=$n python3 bench/bench_whole.py \
                           --prompts 64,254,1030 --warmups 3 --reps 2 --out "$out"
                   done ;;
        pass-ab)   # the layer pass against the chunk order: its GPU tests, then long prompts
                   # of the 30B shape a quarter resident, then the 235B shape under 16 GiB
                   stage pass-tests python3 -m pytest -m gpu -q -ra -p no:cacheprovider \
                       tests/test_layer_pass_cuda_cpu.py
                   stage pass-30b python3 bench/bench_whole.py --orders chunks,layers \
                       --prompts 8179,16000,30118 --warmups 1 --reps 2 --out "$out"
                   stage pass-235b python3 bench/bench_whole.py --orders chunks,layers \
                       --config configs/qwen3-235b-a22b-whole-16g.yaml \
                       --prompts 8179,30118 --warmups 1 --reps 1 --out "$out" ;;
        pass-ring) # the 235B shape's layer pass with a ring of two layers' streamed experts
                   # (bench/notes.md W70: the ring, not the residency, is the pass's lever)
                   sed 's/^ring_mib: .*/ring_mib: 2048/' configs/qwen3-235b-a22b-whole-16g.yaml \
                       > "$out/235b-16g-ring2g.yaml"
                   stage pass-ring python3 bench/bench_whole.py --orders layers \
                       --config "$out/235b-16g-ring2g.yaml" --prompts 8179,30118 --warmups 1 \
                       --reps 1 --out "$out" ;;
        short-ncu) # each table-product launch of a 254-token prefill, every expert resident
                   sed 's/^expert_cache: .*/expert_cache: all/' configs/qwen3-30b-a3b-whole.yaml \
                       > "$out/all-resident.yaml"
                   stage short-ncu "${NCU:-ncu}" -k regex:fused_tab --launch-skip 96 \
                       --launch-count 4 --section SpeedOfLight --section Occupancy \
                       --section WarpStateStats --section LaunchStats python3 -m strata_rt.cli \
                       run "$out/all-resident.yaml" --prompts 254,254 ;;
        *) echo "unknown stage $what"; failures=$((failures + 1)) ;;
    esac
done
echo
printf '%s\n' "${summary[@]}"
exit "$failures"
