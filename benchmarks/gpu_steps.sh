# Sourced by the one-call H200 scripts: records the GPU and versions in $OUT/gpu.txt and defines
#   step NAME TIMEOUT_S COMMAND...   (runs COMMAND into $OUT/NAME.log, appends "NAME rc=… Ns" to $OUT/steps.txt)
#   BUILD_CHECKPOINT DIR LAYERS      (a command for step: convert_throughput's synthetic real-dims checkpoint,
#                                     8 experts per layer, built into DIR)
#   CONVERT_THROUGHPUT ARGS...       (convert_throughput.py, --device cuda only, no 1-worker run, 512MB shards)
#   CONVERT_PROFILE --src DIR ARGS...  (convert_profile.py, --device cuda, 512MB shards)
#   has STEP                         (whether $STEPS names STEP, as a whole word: "moetests" is not "tests")
#   carried_wheels                   (installs the wheels the call carries in .whl into /tmp/site and puts it on
#                                     PYTHONPATH: the H200 image has no xxhash; exits when they do not install)
#   CONVERSION_GPU_TESTS             (a command for step: the conversion and verify GPU tests, --device cuda
#                                     bit-identical to the CPU over every shard)
#   CPU_QUANTIZER_TESTS              (a command for step: the C quantizer's and porter.mxfp8's CPU tests)
#   sparse_runs                      (sparse_checkpoint.py on 16 cores, 20 s with the CPU path, then --device cuda)
#   sparseshm_runs                   (the same, 8 s each, with the checkpoint and its output in /dev/shm)
#   conv2_runs                       (2 cores, 1.92 GB warm, CPU + cuda, five repeats, against the safetensors
#                                     copy and shutil.copyfile)
#   pack TAG                         (everything in $OUT into one archive $OUT/TAG_<steps>.tgz: the device
#                                     returns at most 8 files per call)
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
step() {  # name, timeout seconds, command...
  local name=$1 t=$2; shift 2
  local start=$SECONDS
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - start))s" | tee -a "$OUT/steps.txt"
  tail -3 "$OUT/$name.log"
}
BUILD_CHECKPOINT=(python -c 'import sys; sys.path[:0] = ["benchmarks", "examples", "tests"]; from pathlib import Path
import convert_throughput as ct; ct.build_checkpoint(Path(sys.argv[1]), int(sys.argv[2]), 8)')
CONVERT_THROUGHPUT=(python benchmarks/convert_throughput.py --devices cuda --no-single --max-shard-size 512MB)
CONVERT_PROFILE=(python benchmarks/convert_profile.py --device cuda --max-shard-size 512MB)
has() { [[ " $STEPS " == *" $1 "* ]]; }
carried_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "could not install the carried wheels"; exit 1; }
  export PYTHONPATH=$PYTHONPATH:/tmp/site
}
CONVERSION_GPU_TESTS=(python -m pytest -q -m gpu tests/test_convert.py tests/test_verify_gpu.py -p no:cacheprovider)
CPU_QUANTIZER_TESTS=(python -m pytest -q tests/test_mxfp8_native.py tests/test_mxfp8.py -p no:cacheprovider)
sparse_runs() {
  for d in cpu cuda; do
    step sparse_16c_$d 150 taskset -c 0-15 python benchmarks/sparse_checkpoint.py --seconds 20 --device $d \
      --out "$OUT/sparse_16c_$d.json"
  done
  tail -n 4 "$OUT"/sparse_16c_*.log
}
pack() { tar czf "/tmp/$1.tgz" -C "$OUT" . && rm -rf "${OUT:?}"/* && mv "/tmp/$1.tgz" "$OUT/$1_${STEPS// /_}.tgz"; }
sparseshm_runs() {
  df -h /dev/shm >> "$OUT/gpu.txt"
  for d in cpu cuda; do
    step sparseshm_16c_$d 150 taskset -c 0-15 python benchmarks/sparse_checkpoint.py --seconds 8 --device $d \
      --tmp /dev/shm --out "$OUT/sparseshm_16c_$d.json"
  done
  tail -n 1 "$OUT"/sparseshm_16c_*.log
}
conv2_runs() {
  step conv2 400 taskset -c 0,1 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda --copies copy-safetensors,copy-files \
    --sizes 2 --repeats 5 --out "$OUT/conv2.json"
  grep -h "warm convert\|warm copy\|GB (" "$OUT/conv2.log" | cut -c1-200
}
