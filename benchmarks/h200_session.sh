#!/usr/bin/env bash
# One device call that checks and times everything (see /work/.library/device/METHOD.md): run from the
# repository root on the GPU machine with $OUT set and ENCLAVE_COMMIT naming the commit under test.
#   STEPS="kernels gpu_tests batching" bash benchmarks/h200_session.sh      (one call)
#   STEPS="bench" bash benchmarks/h200_session.sh --quick --workloads a,b     (another: calls are <= 10 min)
#   STEPS="micro profile" ...   kernel microbenchmarks (benchmarks/kernels_*.py) and one-step profiles
#   STEPS="attention" ...       prefill attention kernels against flash SDPA (attention_prefill.{txt,json})
#   STEPS="verify" ...          issue 18: verify-step profiles, 2-4-row projections (then (f) in another call)
#   STEPS="state" ...           issue 13: bf16 recurrent states' gpu tests and accuracy against fp32 states
#   STEPS="recurrent" ...       issue 13: the recurrent kernel's tilings with fp32 and bf16 states
#   STEPS="ncu_recurrent" ...   issue 13: ncu (full set) on that kernel at 256 decodes
#   STEPS="attention_fp8" ...   issue 19: prefill attention over the FP8 cache; "long_fp8": (e) at 1M on it
# Each step's time limit has an environment override (GPU_TESTS_LIMIT, KV_TESTS_LIMIT, BENCH_LIMIT, ...), and
# GPU_TESTS_PATHS narrows the gpu tests, so one call fits under the device's 10 minutes.
# Writes under $OUT: gpu.txt (GPU and stack), kernels.txt (kernel tests compiled on the GPU), gpu_tests.txt
# (`-m gpu` tests), batching_*.{txt,json}, micro.txt + kernels_*.json, profile_*.txt and bench.{txt,json}.
# The constrained step's wheel, fetched here first: `echo /.whl/ >> .git/info/exclude; python3 -m pip download
# --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_31_x86_64 -d .whl
# llguidance==1.9.1` (one abi3 wheel, no dependencies), then run with carry [".whl"].
# While helpers edit the working tree, send a committed snapshot instead: here, `echo /.snap/ >>
# .git/info/exclude; rm -rf .snap; mkdir .snap; git archive HEAD | tar -x -C .snap`, then run with carry
# [".snap"] and `cd .snap && ...`. $OUT returns at most 8 files: write under a scratch folder and tar it.
set -u
OUT=${OUT:?set OUT}
: "${ENCLAVE_COMMIT:?set ENCLAVE_COMMIT to the commit under test: the device copy of .git may be stale}"
export TOKENIZERS_PARALLELISM=false
STEPS=${STEPS:-kernels gpu_tests batching}
for step in $STEPS; do  # every step named is one of the case arms below, before any runs
  grep -qE "^ +$step\)" "${BASH_SOURCE[0]}" || { echo "unknown step: $step" >&2; exit 2; }
done
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__)"
} > "$OUT/gpu.txt" 2>&1
# The GPU image has no sqlalchemy: keep pytest from loading the repository-level conftest there.
python -c "import sqlalchemy" 2>/dev/null && CUT="" || CUT="--confcutdir=tests/engine"
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$?" >> "$OUT/$name.txt"; tail -3 "$OUT/$name.txt"; }
for step in $STEPS; do
  case $step in
    kernels) run kernels 240 python -m pytest -q -p no:cacheprovider $CUT tests/engine/kernels ;;
    gpu_tests) run gpu_tests "${GPU_TESTS_LIMIT:-300}" python -m pytest -q -p no:cacheprovider $CUT -m gpu ${GPU_TESTS_PATHS:-tests/engine} ;;
    batching)
      run batching_triton 150 python benchmarks/engine_batching.py --device cuda --dtype bfloat16 --repeats 3 \
        --json "$OUT/batching_triton.json"
      run batching_torch 150 env ENCLAVE_KERNELS=torch python benchmarks/engine_batching.py --device cuda \
        --dtype bfloat16 --repeats 3 --json "$OUT/batching_torch.json" ;;
    micro) for k in gated_delta moe decoder; do
        run "micro_$k" 90 python "benchmarks/kernels_$k.py" --json "$OUT/kernels_$k.json"
      done ;;
    attention)  # prefill attention (issue 19): rows and packed kernels (every sweep tiling) against flash SDPA
      run attention "${ATTENTION_LIMIT:-180}" python benchmarks/attention_prefill.py --sweep \
        --json "$OUT/attention_prefill.json"
      # 64-position cache blocks: the packed kernel's one-table-read-per-tile path
      run attention_block64 "${BLOCK64_LIMIT:-60}" python benchmarks/attention_prefill.py --block-size 64 --cases 8192,8192@131072 \
        --json "$OUT/attention_prefill_block64.json"
      # the FP8 cache (issue 19: 1M tokens in 150 s): packed and rows over e4m3 caches, rows with e4m3 products
      run attention_fp8 "${ATTENTION_FP8_LIMIT:-90}" python benchmarks/attention_prefill.py --block-size 64 \
        --kv-cache-dtype fp8 --cases 8192,8192@524288 --json "$OUT/attention_prefill_fp8.json" ;;
    profile) run profile 150 python benchmarks/profile_step.py --out "$OUT" --rows 30 ;;
    verify)  # issue 18: (f)'s plain and verify steps profiled as (f) runs them (PDL on), and the dense
      # projections at 2-4 rows, Triton tiles against cuBLAS (benchmarks/verify_step_ops.py's predicted 0.21 ms)
      run profile_verify "${PROFILE_LIMIT:-200}" python benchmarks/profile_step.py --out "$OUT" --rows 40 \
        --cases verify0,verify1,verify3
      run linear_rows "${LINEAR_LIMIT:-240}" python benchmarks/kernels_linear.py --rows 1,2,3,4 --sweep \
        --shapes in_proj_qkvz,out_proj,qkv_proj --json "$OUT/kernels_linear_rows.json" ;;
    fp8_tests) run fp8_tests 200 python -m pytest -q -p no:cacheprovider $CUT -m gpu \
        tests/engine/kernels/test_moe_fp8_triton.py tests/engine/kernels/test_fp8_triton.py \
        tests/engine/kernels/test_moe_triton.py tests/engine/test_fp8_experts.py tests/engine/test_fp8.py ;;
    tiles)  # FP8 at every size, bf16 past the decode table's range; merges the winners into the GPU's table
      run tiles_fp8 240 python benchmarks/moe_tiles.py --dtypes fp8 --json "$OUT/tiles_fp8.json" --write-config
      run tiles_bf16 200 python benchmarks/moe_tiles.py --dtypes bf16 --tokens 1024,4096,16384 \
        --json "$OUT/tiles_bf16.json" --write-config
      cp engine/kernels/moe/configs/*.json "$OUT/" ;;
    fp8_new)  # the FP8 kernels of the norm-quantised path at real shapes, and the FP8 engine against the CPU
      run fp8_new 240 python -m pytest -q -p no:cacheprovider $CUT -m gpu \
        tests/engine/kernels/test_norm_fp8_triton.py tests/engine/kernels/test_fp8_prequantized.py \
        tests/engine/kernels/test_fp8_gemm_config.py tests/engine/kernels/test_fp8_triton.py \
        tests/engine/kernels/test_linear_split_sum.py tests/engine/kernels/test_moe_fp8_triton.py \
        tests/engine/kernels/test_moe_gemv_triton.py "tests/engine/test_gpu.py::test_cuda_fp8_matches_cpu" ;;
    fp8_decode_tiles)  # decode-sized FP8 tiles in CUDA graphs; merges the dense GEMM's winners into the table
      run fp8_decode_tiles "${TILES_LIMIT:-260}" python benchmarks/fp8_decode_tiles.py \
        --json "$OUT/fp8_decode_tiles.json" --write-config
      cp engine/kernels/fp8/configs/*.json "$OUT/" ;;
    profile_fp8)  # FP8 steps with PDL off (kernel times not inflated by in-kernel waits)
      ENCLAVE_PDL=0 run profile_fp8 "${PROFILE_LIMIT:-200}" python benchmarks/profile_step.py --out "$OUT" \
        --rows 30 --quantization fp8 --cases "${PROFILE_CASES:-decode1,decode64,decode512,mixed}" ;;
    fp8_tiles)  # the dense FP8 GEMM's tiles at the real projections; merges the winners into the GPU's table
      run fp8_tiles 300 python benchmarks/fp8_gemm_tiles.py --json "$OUT/fp8_tiles.json" --write-config
      cp engine/kernels/fp8/configs/*.json "$OUT/" ;;
    gemm_lab)  # prefill GEMMs: dense FP8 (ours, cuBLASLt, bf16), grouped experts over tiles, torch's grouped GEMMs
      run gemm_lab "${LAB_LIMIT:-240}" python benchmarks/gemm_lab.py --parts "${LAB_PARTS:-probe,dense,grouped,torch}" \
        --json "$OUT/gemm_lab.json" ;;
    constrained)  # (k) needs llguidance, absent from the GPU image: carry its cp312 wheel in .whl (see below)
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/llguidance-*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      # llguidance's fill on this host's cores, per thread count, with a lexer group per thread (the engine's)
      # and with one shared lexer (before 2026-12-05); no GPU used; FILL_SWEEP=0 skips it
      [ "${FILL_SWEEP:-1}" = 0 ] || run grammar_fill "${FILL_LIMIT:-150}" python benchmarks/grammar_fill.py --batches 64,256 \
        --threads 1,4,8 --pools llguidance,python --groups auto,1 --schemas k --json "$OUT/grammar_fill.json"
      run "bench_k" "${BENCH_LIMIT:-300}" python -m engine.bench --preset qwen3.5-35b-a3b --workloads k \
        --batches 64,256 --json "$OUT/bench_k.json" "$@" ;;
    kv_fp8)  # the FP8 KV cache (issue 19): its gpu tests, then greedy agreement and logit error over 256 tokens
      # on the random-weight preset; (b) and (d) on it: STEPS=bench BENCH_TAG=_kv_fp8 ... --kv-cache-dtype fp8
      run kv_fp8_tests "${KV_TESTS_LIMIT:-240}" python -m pytest -q -p no:cacheprovider $CUT -m gpu \
        tests/engine/kernels/test_attention_fp8_kv.py tests/engine/test_fp8_kv_cache.py
      run kv_fp8_accuracy "${KV_LIMIT:-300}" python -m engine.bench.kv_accuracy --preset qwen3.5-35b-a3b \
        --seqs 8 --prompt-len 512 --tokens 256 --json "$OUT/kv_fp8_accuracy.json" ;;
    recurrent)  # issue 13: the recurrent gated delta kernel's tilings at decode batches, fp32 and bf16 states
      # (ncu on the launcher's choice: ncu --clock-control none --kernel-name regex:_recurrent_kernel python
      # benchmarks/recurrent_tiles.py --batches 256 --once)
      run recurrent_tiles "${TILES_LIMIT:-150}" python benchmarks/recurrent_tiles.py --batches 64,256 \
        --json "$OUT/recurrent_tiles.json" ;;
    ncu_recurrent)  # issue 13: ncu on the launcher's recurrent kernel at 256 decodes, fp32 then bf16 states
      NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
      run ncu_recurrent "${NCU_LIMIT:-150}" "${NCU:-ncu}" --clock-control none --set full \
        --kernel-name regex:_recurrent_kernel python benchmarks/recurrent_tiles.py --batches 256 --once ;;
    attention_fp8)  # issue 19: the FP8 cache's prefill kernels alone (bf16 and e4m3 products; from 16,384
      # positions of context through a copy made once per step: dequantised, or with values transposed)
      run attention_fp8 "${ATTENTION_FP8_LIMIT:-150}" python benchmarks/attention_prefill.py --block-size 64 \
        --kv-cache-dtype fp8 --cases 8192,32768,8192@131072,8192@524288 --json "$OUT/attention_prefill_fp8.json" ;;
    long_fp8)  # issue 19: a 1,000,000-token prompt over the FP8 cache with e4m3 attention products (bf16
      # weights: needs the H200's memory)
      ENCLAVE_FP8_ATTENTION=1 run bench_e1m_fp8 "${BENCH_LIMIT:-540}" python -m engine.bench --preset qwen3.5-35b-a3b \
        --workloads e --long-prompt 1000000 --kv-cache-dtype fp8 --json "$OUT/bench_e1m_fp8.json" ;;
    state)  # issue 13: bf16 recurrent states (--state-dtype bfloat16): the DeltaNet kernels' gpu tests with
      # both state dtypes (and the FP8 cuBLAS bound not yet run on a GPU), then greedy agreement and logit
      # error against fp32 states over 256 tokens on the random-weight preset; benches: STEPS=bench ... --state-dtype bfloat16
      run state_tests "${STATE_TESTS_LIMIT:-180}" python -m pytest -q -p no:cacheprovider $CUT -m gpu \
        tests/engine/kernels/test_state_dtype.py tests/engine/kernels/test_gated_delta_triton.py \
        tests/engine/kernels/test_deltanet_step_triton.py tests/engine/kernels/test_fp8_cublas.py
      run state_accuracy "${STATE_LIMIT:-240}" python -m engine.bench.kv_accuracy --preset qwen3.5-35b-a3b \
        --seqs 8 --prompt-len 512 --tokens 256 --kv-cache-dtype auto --state-dtype bfloat16 \
        --json "$OUT/state_accuracy.json" ;;
    kv_diagnose)  # where kv_accuracy's bf16 baseline went NaN on the GPU (demo model), and the noise floor
      run kv_diagnose "${DIAGNOSE_LIMIT:-150}" python benchmarks/diagnose_kv_accuracy.py --tokens "${DIAGNOSE_TOKENS:-256}"
      # the same without programmatic dependent launch: kv_accuracy's decode steps launch eagerly, outside graphs
      # (DIAGNOSE_NOPDL=0 skips it)
      [ "${DIAGNOSE_NOPDL:-1}" = 0 ] || run kv_diagnose_nopdl "${DIAGNOSE_LIMIT:-150}" env ENCLAVE_PDL=0 python benchmarks/diagnose_kv_accuracy.py \
        --tokens "${DIAGNOSE_TOKENS:-256}" ;;
    bench)  # BENCH_TAG names the files when one call runs several benches; BENCH_LIMIT caps the seconds
      run "bench${BENCH_TAG:-}" "${BENCH_LIMIT:-540}" python -m engine.bench --preset qwen3.5-35b-a3b \
        --json "$OUT/bench${BENCH_TAG:-}.json" "$@" ;;
  esac
done
