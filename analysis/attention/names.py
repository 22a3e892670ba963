"""The names the attention commands accept, importable without the attention maths (the command
line's argument checks run before anything heavy is imported): the what-if methods of
`compression` and the one-number columns of `head_importance`."""

EVICTION = (
    "streaming",
    "snapkv",
    "pyramidkv",
    "observed",
    "tova",
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
