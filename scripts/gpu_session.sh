#!/usr/bin/env bash
# One device call: install the package, then check and time everything that needs the GPU.
#   bash scripts/gpu_session.sh [STEP ...]     steps: env fp8 profile budget compare offload bench tests-kernels tests tests-full
#                                              sweep variants sanitize generate compile-check recipes recipes-wan
#                                              generate-compile crossover validate-model stages
#                                              families families-validate compile-startup plan-verify sage2-block
#                                              routing caches (those seven: not in the default)
#                                              (default: all)
# Wheels carried in .whl/ (e.g. imageio-ffmpeg, which the GPU image lacks) are installed first.
# Results go under $OUT (or ./gpu-results): one log per step and one archive, because the device
# tool brings back at most 8 files. CALL_BUDGET=SECONDS caps every step by the time left in the call, so the archive
# is written before the device tool's own limit (a step with under 30 s left is skipped; a later call resumes).
set -uo pipefail
out=${OUT:-gpu-results}
work=/tmp/dit-accel-gpu
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME=$work/cache
steps=${*:-env fp8 profile budget compare offload bench tests-kernels tests tests-full sweep variants sanitize generate compile-check recipes recipes-wan generate-compile crossover validate-model stages}

step() {  # step NAME SECONDS COMMAND...: if NAME is asked for, `timed`
  [[ " $steps " == *" $1 "* ]] || return 0
  timed "$@"
}
timed() {  # timed NAME SECONDS COMMAND...: run with a time limit, log to $work/NAME.log, report the status
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  if [[ -n ${CALL_BUDGET:-} ]]; then
    local left=$((CALL_BUDGET - SECONDS))
    if ((left < 30)); then echo "step $name: skipped, $left s left in the call" | tee -a "$work/steps.txt"; return 0; fi
    ((limit > left)) && limit=$left
  fi
  timeout "$limit" "$@" >"$work/$name.log" 2>&1
  echo "step $name: exit $? in $((SECONDS - t0)) s" | tee -a "$work/steps.txt"
}

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >>"$work/install.log" 2>&1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$work/install.log" 2>&1 \
  || { echo "install failed"; cat "$work/install.log"; }
step env 60 bash -c 'nvidia-smi; python3 -c "import torch, triton, cutlass, diffusers; print(torch.__version__, triton.__version__, diffusers.__version__, torch.cuda.get_device_name())"'
step fp8 300 python3 scripts/check_fp8_attention.py --out "$work/fp8" --budget-s 240
step profile 240 python3 -m dit_accel profile-block --validate 50 --out "$work/profile"
step budget 120 python3 -m dit_accel profile-block --memory-budget 16GiB --runs 5 --out "$work/budget16"
step compare 240 python3 -m dit_accel profile-block --compare-attn cudnn,fa4,fp8,fp8+rope,fp8-v1 --out "$work/compare"
# The whole H3 block stack (50 blocks, 64.5 GB): resident on the H200, then streamed under a 16 GiB cap.
step offload 420 bash -c "python3 -m dit_accel profile-block --validate 50 --runs 3 --out $work/resident50 \
  && python3 -m dit_accel profile-block --validate 50 --runs 3 --offload stream --memory-budget 16GiB --out $work/stream50"
step bench 240 python3 -m dit_accel bench-attention ${BENCH_BACKENDS:+--backends $BENCH_BACKENDS} --out "$work/bench"
# The two full-size tests (the H3 VAE decode, ~150 s; the whole 66 GB transformer) run in their own step.
# The kernels' GPU tests (~5 min with the persistent, row-sum and three-warpgroup tests), then the rest.
step tests-kernels 420 python3 -m pytest tests/kernels -q -m gpu -p no:cacheprovider -rfE --durations=5
step tests 420 python3 -m pytest tests -q -m gpu -p no:cacheprovider -rfE -k "not full_size" --ignore tests/kernels
step tests-full 420 python3 -m pytest tests -q -m gpu -p no:cacheprovider -rfE --durations=5 -k full_size
sweep_shapes=$(for d in 128 64; do for s in 4096 8192 16384 30272 37710 75600; do printf '1x56x%sx%s,' $s $d; done; done)
step sweep 300 python3 -m dit_accel bench-attention --shapes "${sweep_shapes%,}" --backends cudnn,fa4,fa3,fa3-fp8,fp8,fp8-int8qk,sage2,cudnn-fp8 \
  --out "$work/sweep"
# What fp8_attention runs (default, `tuning`: persistent CTAs at D = 64 and at D = 128 up to 12288 keys, the tensor
# core's row sums at D = 64) against one CTA per tile and persistent at every length (D128), three stages, and
# the row sums without persistence (D64). Timed in interleaved rounds (dit_accel.timing.time_interleaved).
variants128="default,128x2,128x2p,128x3"
variants64="default,128x2r"
step variants 300 bash -c "python3 scripts/check_fp8_sm90.py --out $work/variants128 --variants $variants128 \
  --seq-lens 4096,8192,30272 --no-v1 --budget-s 140 && python3 scripts/check_fp8_sm90.py \
  --out $work/variants64 --variants $variants64 --head-dim 64 --seq-lens 4096,8192,30272 --no-v1 --budget-s 140"
step sanitize 240 bash -c "compute-sanitizer --tool racecheck python3 scripts/check_fp8_sm90.py --sanitize --out $work/race \
  && compute-sanitizer --tool memcheck --report-api-errors no python3 scripts/check_fp8_sm90.py --sanitize --out $work/mem"

step generate 240 bash -c "python3 -m dit_accel make-tiny-pipeline wan $work/tiny-wan \
  && python3 -m dit_accel generate --pipeline $work/tiny-wan --compare bf16 --out $work/generate"

step compile-check 200 python3 scripts/check_compile.py --out "$work/compile-check"
# What a compiled recipe's first call costs, phase by phase, ours beside the torchao recipe, each case in a fresh
# process on empty caches (and ours again on the caches its first run left).
step compile-startup 560 python3 scripts/compile_startup.py --suite "$work/compile-startup"
# Recipes side by side, one process, same block and inputs: diffusers' default eager, compiled, compiled with
# torchao FP8 linears (what a user assembles without us), and ours.
recipes=cudnn,cudnn+compile,cudnn+fp8-linear+compile,fp8+rope+fp8-linear+compile,fp8+prologue+fp8-linear+compile,fp8+rope
step recipes 420 python3 -m dit_accel profile-block --compare-attn "$recipes" --out "$work/recipes"
step recipes-wan 300 python3 -m dit_accel profile-block --model wan --runs 3 --warmup 2 \
  --compare-attn cudnn,cudnn+compile,cudnn+fp8-linear+compile,fp8+fp8-linear+compile --out "$work/recipes-wan"
step generate-compile 240 bash -c "python3 -m dit_accel make-tiny-pipeline wan $work/tiny-wan-c \
  && python3 -m dit_accel generate --pipeline $work/tiny-wan-c --compare bf16 --compile --linear fp8 --out $work/generate-compile"

# The router's crossover (copy the JSON it writes into dit_accel/attention/crossover_data/), then the whole
# transformer against its extrapolation, resident and streamed under 16 GiB, then the pipeline's stages.
step crossover 300 python3 -m dit_accel bench-attention --crossover --out "$work/crossover"
step validate-model 420 bash -c "python3 -m dit_accel profile-block --validate model --runs 5 --out $work/validate-model \
  && python3 -m dit_accel profile-block --validate model --offload stream --memory-budget 16GiB --runs 3 --out $work/validate-model-stream"
step stages 600 python3 -m dit_accel profile-block --stages all --compare-attn cudnn,fp8+prologue+fp8-linear+compile --runs 2 --warmup 1 --out "$work/stages"

# The other families, one job per GPU at a time (a device with several GPUs runs them side by side): each
# family's block by recipe (diffusers' default eager, torch.compile + torchao FP8 linears +
# cuDNN, ours), then whole transformers against their extrapolation. Logs and runs in $work/NAME/.
on_gpus() {  # on_gpus NAME SECONDS < jobs (one command a line), round-robin over the visible GPUs
  local name=$1 limit=$2 gpus jobs t0=$SECONDS
  [[ " $steps " == *" $name "* ]] || return 0
  gpus=$(nvidia-smi -L | wc -l)
  mapfile -t jobs
  mkdir -p "$work/$name"
  for ((g = 0; g < gpus; g++)); do
    (for ((j = g; j < ${#jobs[@]}; j += gpus)); do
      CUDA_VISIBLE_DEVICES=$g timeout "$limit" bash -c "${jobs[j]}" >"$work/$name/job$j.log" 2>&1
      echo "step $name job $j (GPU $g): exit $? at $((SECONDS - t0)) s: ${jobs[j]}" | tee -a "$work/steps.txt"
    done) &
  done
  wait
}
family_recipes=${FAMILY_RECIPES:-cudnn,cudnn+fp8-linear+compile,fp8+fp8-linear+compile}
for family in ${FAMILIES:-hunyuan-video hunyuan-video-1.5 hunyuan-video-framepack ltx-video ltx-2 cogvideox mochi \
    skyreels-v2 wan-vace chronoedit wan-animate anyflow helios cosmos cosmos-predict2.5 easyanimate kandinsky-5 \
    kandinsky-6 sana-video allegro motif-video}; do
  echo "python3 -m dit_accel profile-block --model $family --runs 3 --warmup 1 --compare-attn $family_recipes \
    --out $work/families/$family"
done | on_gpus families ${FAMILY_LIMIT:-560}
for family in ${VALIDATE_FAMILIES:-cogvideox mochi hunyuan-video ltx-video}; do
  echo "python3 -m dit_accel profile-block --model $family --validate model --runs 3 --out $work/families-validate/$family"
done | on_gpus families-validate 560

# dit-accel plan checked where it can be: each family's eager block, then every knob combination on the same block
# and inputs and the whole transformer streamed under 16 GiB (plan --verify writes its runs under the cwd's outputs/).
# The families whose default video's block, profiled, would not fit the 16 GiB budget run at 61 x 544x960.
# PLAN_RUNS: timed runs a recipe (the median is reported; more where host stalls move a median of 3). PLAN_GPU: the
# datasheet row of this GPU (h200, h100-sxm). PLAN_BUDGET= (empty) leaves the streamed passes out.
plan_budget=${PLAN_BUDGET-16GiB}
for family in ${PLAN_FAMILIES:-minimax-h3 wan}; do
  case $family in
    hunyuan-video | hunyuan-video-1.5 | motif-video) shape="--frames 61 --height 544 --width 960" ;;
    *) shape="" ;;
  esac
  echo "mkdir -p $work/plan-verify/$family && cd $work/plan-verify/$family && python3 -m dit_accel profile-block \
    --model $family $shape --runs ${PLAN_RUNS:-3} --warmup 1 --out run \
    && python3 -m dit_accel plan run --verify ${plan_budget:+--memory-budget $plan_budget} \
      --gpu ${PLAN_GPU:-h200} --out plan"
done | on_gpus plan-verify ${PLAN_LIMIT:-560}
# The router on this GPU, from an empty cache (the crossover measured on first use where none ships): each family's
# block with diffusers' default and our full recipe, then each of its attention calls timed with cuDNN and our
# kernel beside the router's pick, then the direct calls where our kernel loses (a short key side, one tile plus a
# row, one query row). The measured crossover is kept as $work/routing/crossover-measured.json.
if [[ " $steps " == *" routing "* ]]; then
  mkdir -p "$work/routing"
  for family in ${ROUTING_FAMILIES:-minimax-h3 wan kandinsky-5}; do
    timed "routing-$family" 300 bash -c "python3 -m dit_accel profile-block --model $family --runs ${ROUTING_RUNS:-3} \
      --warmup 1 --compare-attn ${ROUTING_RECIPES:-cudnn,fp8+fp8-linear+compile} --out $work/routing/$family \
      && python3 -m dit_accel bench-attention --backends cudnn,fp8 --runs 10 \
      --shapes \$(python3 scripts/call_shapes.py $work/routing/$family) --out $work/routing/$family-calls"
  done
  timed routing-direct 120 python3 -m dit_accel bench-attention --backends cudnn,fp8 \
    --shapes 1x56x30272x777x128,1x56x129x128,1x56x1x4097x128,1x56x47616x512x64 --out "$work/routing/direct"
  cp "$XDG_CACHE_HOME"/dit-accel/crossover/*.json "$work/routing/crossover-measured.json" 2>/dev/null
fi
# Step caches on a real-size transformer in its pipeline (make-tiny-pipeline --transformer: random weights of
# realistic scale, tiny text encoder and VAE) over the pipeline's own 50 steps: per recipe (diffusers' default
# attention, our full recipe) and group of caches, one generate call that runs the recipe without a cache, then
# with each cache of the group, each compared against it (report.json: each run's skipped passes, the changes a
# threshold cache measured, the graphs compiled during its timed call; the speed-ups and PSNR/SSIM). The block is
# profiled at the same video, with the transformer outside its blocks, for `plan --cache` ($work/caches/FAMILY/block;
# plan --cache taylorseer --verify beside it runs the whole video under TaylorSeer on the transformer alone). The
# pipeline folder is kept between calls on a warm machine; dbcache (cache-dit, the peer) needs its wheel in .whl/.
# CACHE_FAMILIES (wan, cogvideox), CACHE_RECIPES, CACHE_GROUPS (groups separated by spaces, caches within one by
# commas), CACHE_BLOCK_RECIPES (empty: the eager block alone) and CACHE_VERIFY=0 (no plan --verify) choose a part.
if [[ " $steps " == *" caches "* ]]; then
  for family in ${CACHE_FAMILIES:-wan}; do
    case $family in  # the preset and a short video at the pipeline's own size
      wan) preset=wan2.1-t2v-1.3b video="--frames 17 --height 480 --width 832" ;;
      cogvideox) preset=cogvideox-5b video="--frames 13 --height 480 --width 720" ;;
      *) echo "caches: no preset for $family" | tee -a "$work/steps.txt"; continue ;;
    esac
    c=$work/caches/$family
    mkdir -p "$c"
    [[ -d $c/pipeline ]] || timed "caches-$family-build" 300 python3 -m dit_accel make-tiny-pipeline "$family" \
      "$c/pipeline" --transformer "$preset"
    block_recipes=${CACHE_BLOCK_RECIPES-native,fp8+fp8-linear+compile}  # the eager baseline first, for plan
    [[ -d $c/block ]] || timed "caches-$family-block" 400 python3 -m dit_accel profile-block --model "$family" \
      --preset "$preset" $video --outside measure ${block_recipes:+--compare-attn $block_recipes} --runs 5 \
      --warmup 2 --out "$c/block"
    for recipe in ${CACHE_RECIPES:-fp8+fp8-linear+compile native}; do
      for group in ${CACHE_GROUPS:-taylorseer,pab,faster fbc:0.2,dbcache:0.2 mag:calibrate,mag}; do
        name=$recipe--${group//,/-}
        [[ -f $c/$name/report.json ]] || timed "caches-$family-$name" 400 python3 -m dit_accel generate \
          --pipeline "$c/pipeline" $video --compare "$recipe" --attn "$recipe+cache=${group//,/,$recipe+cache=}" \
          --out "$c/$name"
      done
    done
    # plan's prediction of every run above beside what it measured (no GPU work), then, last, its TaylorSeer
    # prediction beside the whole video run under it (transformer alone, every knob verified)
    runs=$(for d in "$c"/*--*/; do [[ -f $d/report.json ]] && printf -- '--cache-run %q ' "${d%/}"; done)
    [[ -z $runs || ! -d $c/block ]] || timed "caches-$family-plan-runs" 120 bash -c \
      "rm -rf '$c/plan-cache-runs' && python3 -m dit_accel plan '$c/block' $runs --gpu h100-sxm,h200 --out '$c/plan-cache-runs'"

    [[ ${CACHE_VERIFY:-1} == 0 || -d $c/plan-taylorseer ]] || (cd "$c" && timed "caches-$family-plan" 560 \
      python3 -m dit_accel plan block --cache taylorseer --verify --out plan-taylorseer)
  done
fi
# SageAttention2 beside ours and FA3 FP8 on the q/k/v an H3 block feeds its attention (part 4 of the GPU bundle).
step sage2-block 300 python3 -m dit_accel bench-attention --inputs block --backends cudnn,fa3-fp8,fp8,fp8-int8qk,sage2 \
  --out "$work/sage2-block"

# (no videos of the caches step: nine of them passed the 16 MiB a file the device tool brings back)
tar czf "$out/results.tgz" -C "$work" --exclude='cache' --exclude='*.json.gz' --exclude='caches/*/pipeline' \
  --exclude='caches/*/*/*.mp4' .
cat "$work/steps.txt"
for f in "$work"/*.log; do echo "=== $(basename "$f") (tail)"; tail -25 "$f"; done
