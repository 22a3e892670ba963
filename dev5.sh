set -e
R=$PWD
mkdir -p /root/stage && cp .device/a/* /root/stage/
python3 -m pip install -q --no-index --no-deps --target /tmp/site $(ls .device/e/*.whl | grep -v ml_dtypes) 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$R KVSNAP_CACHE=/tmp/kvc
python3 -c "from pathlib import Path; from benchmarks.cli_bench import files; files(Path('/tmp/cli'), ('tiny','bf16','fp32'))"
echo staged
