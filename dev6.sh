set -e
R=$PWD
bash .device/b/install.sh
for T in $R $R/.device/old; do ln -sfn $T/analysis $T/kvsnap/analysis; ln -sfn $T/capture $T/kvsnap/capture; done
python3 -m compileall -q kvformat analysis capture kvsnap benchmarks .device/old
export PYTHONPATH=/tmp/site:$R MLX_PTX_CACHE_DIR=/tmp/ptx KVSNAP_CACHE=/tmp/kvc
t0=$(date +%s)
for T in $R $R/.device/old; do (cd $T && python3 -m kvsnap stats /tmp/cli/qwen3-8b-bf16.kv --backend mlx -o /tmp/w.parquet --force > /dev/null); done
echo "mlx warm-up $(( $(date +%s) - t0 )) s"
python3 -m benchmarks.cli_bench --dir /tmp/cli --backends mlx --files bf16,fp32 --runs 5 --tree $R/.device/old
echo "cli_bench $(( $(date +%s) - t0 )) s"
python3 -m kvsnap stats /tmp/cli/qwen3-8b-bf16.kv -o /tmp/w.parquet --force > /dev/null
python3 -m benchmarks.cli_bench --dir /tmp/cli --backends cpu --files bf16 --runs 4
echo "done $(( $(date +%s) - t0 )) s"
