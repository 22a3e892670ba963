"""The names the attention commands accept, importable without the attention maths (the command
line's argument checks run before anything heavy is imported): the what-if methods of
`compression` and the one-number columns of `head_importance`."""

EVICTION = (
    "streaming",
    "snapkv",
    "pyramidkv",
    "adakv",
    "observed",
    "tova",
    "expected_attention",
    "knorm",
    "keydiff",
    "lagkv",
    "cur",
    "h2o",
    "random",
)
"""The what-if methods that evict keys."""
QUANTIZATION = {
    "kivi2": ("channel", 2),
    "kivi4": ("channel", 4),
    "token2": ("token", 2),
    "token4": ("token", 4),
}
"""The what-if methods that quantize K and V: (grouping, bits)."""
METHODS = (*EVICTION, *QUANTIZATION)
NOT_FROM_A_FILE = {
    "qfilter": "qfilter scores keys by filters trained per model (kvpress's QFilterPress downloads them); "
    "a file holds no such filters",
    "kvzip": "kvzip scores keys by how well the model reconstructs the context from the cache (kvpress's "
    "KVzipPress runs the model again); a file cannot run the model",
    "duo_attention": "duo_attention needs a head pattern: kvsnap export --duo-attention DIR writes one from "
    "this file's scores for kvpress's DuoAttentionPress",
}
"""kvpress methods `simulate` cannot compute from a file, each with why (said in one line)."""

SCALARS = (
    "sink_mass",
    "local_mass",
    "entropy",
    "entropy_normalized",
    "mean_distance",
    "retrieval_score",
    "streaming_error",
)
"""The one-number columns of the attention statistics, for ``kvsnap plot --stat`` (a layers x
query heads heatmap)."""
