set -e
R=$PWD
mkdir -p /root/stage && cp .device/a/* /root/stage/
python3 -m pip install -q --no-index --no-deps --target /tmp/site $(ls .device/e/*.whl | grep -v ml_dtypes) 2>&1 | tail -2
ln -sfn $R/analysis $R/kvsnap/analysis; ln -sfn $R/capture $R/kvsnap/capture
export PYTHONPATH=/tmp/site:$R KVSNAP_CACHE=/tmp/kvc
python3 -m compileall -q kvformat analysis capture kvsnap benchmarks
t0=$(date +%s)
python3 -c "from pathlib import Path; from benchmarks.cli_bench import files; files(Path('/tmp/cli'), ('tiny','bf16','fp32'))"
echo "files $(( $(date +%s) - t0 )) s"
