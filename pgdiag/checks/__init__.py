"""Checks of rollout data, each implemented once on plain arrays and called by `check`, `metrics` and `compare`.

`pairs` (two log-prob streams on the same tokens: shift, zero fill, NaN, positive values), `signatures` (causes
named from the log-probs alone: temperature, processed log-probs, first token, stale steps, extreme tokens),
`samples` (two runs: matched samples, tokens, loss masks), `metadata` (footers), and `run` (`check_run`,
`check_frame`: the reader's validation plus all of these for `pgdiag check`).
"""
