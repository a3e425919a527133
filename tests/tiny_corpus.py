"""The tiny synthetic corpus the end-to-end tests share (8 + 4 speakers, ~1 s utterances).

TOML fragments with a "{cache}" placeholder; test configs add their own name, seed,
[train] and [federated] tables around them.
"""

TINY_DATA = """[data]
cache_dir = "{cache}"
workers = 1
[data.synthetic]
n_train_speakers = 8
n_test_speakers = 4
train_utts_per_speaker = 5
test_utts_per_speaker = 3
min_duration_s = 1.0
max_duration_s = 1.5
difficulty = "clean"
"""

TINY_EVAL = """[eval]
asnorm_top_n = 4
lda_dim = 6
"""
