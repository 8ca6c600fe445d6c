"""Text to token ids without torch: the word cache (:mod:`.word_cache`) and the process pool
that runs it on every core (:mod:`.pool`).

Nothing here imports torch or a torch-importing package of hetseq_hpc (only
:mod:`hetseq_hpc.errors`; ``lint-imports`` checks it): the pool's workers are fresh
interpreters (``spawn``) that import this package alone, so they start in well under a second
and inherit no thread of the training process that asked for them.
"""
