set -e
R=$PWD
bash .device/b/install.sh
ln -sfn $R/analysis $R/kvsnap/analysis; ln -sfn $R/capture $R/kvsnap/capture
python3 -m compileall -q kvformat analysis capture kvsnap benchmarks
export PYTHONPATH=/tmp/site:$R MLX_PTX_CACHE_DIR=/tmp/ptx KVSNAP_CACHE=/tmp/kvc
t0=$(date +%s)
python3 -m kvsnap stats /tmp/cli/qwen3-8b-bf16.kv --backend mlx -o /tmp/w.parquet --force > /dev/null
echo "mlx warm-up $(( $(date +%s) - t0 )) s"
B=/tmp/cli/qwen3-8b-bf16.kv; F=/tmp/cli/seed-fp32.kv
python3 -m benchmarks.ab --mode stats:all:1:mlx:warm3 --a . --b . --b-env KVSNAP_ROW_SPLIT=1 --rounds 3 $B
python3 -m benchmarks.ab --mode stats:all:1:mlx:warm3 --a . --b . --b-env KVSNAP_ROW_SPLIT=2 --rounds 3 $B
python3 -m benchmarks.ab --mode stats:all:1:mlx --a . --b . --b-env KVSNAP_ROW_SPLIT=1 --rounds 3 $B
echo "bf16 $(( $(date +%s) - t0 )) s"
python3 -m benchmarks.ab --mode stats:all:1:mlx:warm3 --a . --b . --b-env KVSNAP_ROW_SPLIT=1 --rounds 2 $F
echo "done $(( $(date +%s) - t0 )) s"
