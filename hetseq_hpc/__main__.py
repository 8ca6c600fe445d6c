"""``python -m hetseq_hpc task=bert cluster=local ...``"""

from hetseq_hpc.cli import main

if __name__ == "__main__":
    main()
