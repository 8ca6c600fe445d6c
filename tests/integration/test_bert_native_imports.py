"""A fresh interpreter running the worker's imports and the plain-PyTorch BERT does not import
transformers (the reference of tests/unit/test_bert_native.py, seconds to import)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_worker_and_bert_model_do_not_import_transformers():
    """A fresh interpreter: the worker module, the default BERT model and its optimizer leave
    transformers (seconds to import) out of ``sys.modules``; sympy too, until torch.optim pulls
    in torch._dynamo (checked before the optimizer)."""
    code = textwrap.dedent("""
        import sys
        import torch
        import hetseq_hpc.worker
        from hetseq_hpc.config.schema import BertModelConfig
        from hetseq_hpc.tasks.bert.mlm_model import BertMaskedLM
        from hetseq_hpc.train.optim import build_scheduler
        model = BertMaskedLM(BertModelConfig(), 8192)
        model(torch.zeros(2, 16, dtype=torch.long), torch.ones(2, 16, dtype=torch.long)).backward()
        print(sorted(m for m in ("transformers", "sympy") if m in sys.modules))
        optimizer = torch.optim.AdamW(model.parameters())
        build_scheduler(optimizer, "cosine", 3, 10)
        print("transformers" in sys.modules)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    assert out == ["[]", "False"]
