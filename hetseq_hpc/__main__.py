"""``python -m hetseq_hpc task=bert cluster=local ...`` (= ``hetseq-hpc``)."""

from hetseq_hpc.cli import main

if __name__ == "__main__":
    main()
