"""The plain-PyTorch BERT (hetseq_hpc.tasks.bert.encoder/model) against transformers'
``BertForMaskedLM``, which it replaced on the worker's import path: same state_dict layout, same
initial weights for a seed, same loss and gradients, and the LR schedules against
``transformers.get_scheduler``. transformers stays installed and is the reference here only.
(That the worker does not import it: tests/integration/test_bert_native_imports.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetseq_hpc.config.schema import BertModelConfig
from hetseq_hpc.tasks.bert.mlm_data import IGNORE_INDEX, PAD_ID
from hetseq_hpc.tasks.bert.mlm_model import BertMaskedLM
from hetseq_hpc.train.optim import build_scheduler

#: transformers and datasets are imported by the module's first test, on the one worker this
#: group runs on, not while every worker collects the suite
pytestmark = pytest.mark.xdist_group("hf")


@pytest.fixture(scope="module", autouse=True)
def _needs_transformers():
    """Skips the test where transformers is not installed."""
    pytest.importorskip("transformers")


CFG = BertModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, dropout=0.1, max_seq_len=32
)
VOCAB = 300


class HFWrapped(nn.Module):
    """transformers' model as this project built it before (``self.mlm``), same loss."""

    def __init__(self, cfg: BertModelConfig, vocab_size: int):
        super().__init__()
        import transformers

        self.mlm = transformers.BertForMaskedLM(
            transformers.BertConfig(
                vocab_size=vocab_size,
                hidden_size=cfg.hidden_size,
                num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads,
                intermediate_size=cfg.intermediate_size,
                hidden_dropout_prob=cfg.dropout,
                attention_probs_dropout_prob=cfg.dropout,
                max_position_embeddings=cfg.max_seq_len,
                type_vocab_size=2,
                pad_token_id=PAD_ID,
            )
        )

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.mlm.bert(input_ids=input_ids).last_hidden_state
        selected = labels != IGNORE_INDEX
        logits = self.mlm.cls(hidden[selected])
        return F.cross_entropy(logits.float(), labels[selected], reduction="sum")


def _batch(seed: int = 3, batch: int = 4):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, CFG.max_seq_len), generator=gen)
    masked = torch.rand(batch, CFG.max_seq_len, generator=gen) < 0.15
    masked[:, 1] = True  # at least one masked token per row
    return ids, torch.where(masked, ids, torch.full_like(ids, IGNORE_INDEX))


def test_state_dict_layout_is_transformers():
    """Same keys in the same order, same shapes, same parameter order (the optimizer's state
    is indexed by it), same ties: old checkpoints load with strict=True."""
    native, ref = BertMaskedLM(CFG, VOCAB), HFWrapped(CFG, VOCAB)
    assert [(k, v.shape) for k, v in native.state_dict().items()] == [
        (k, v.shape) for k, v in ref.state_dict().items()
    ]
    assert [(k, p.shape) for k, p in native.named_parameters()] == [
        (k, p.shape) for k, p in ref.named_parameters()
    ]
    assert not any("pooler" in k for k in native.state_dict())
    pred = native.mlm.cls.predictions
    assert pred.decoder.weight is native.mlm.bert.embeddings.word_embeddings.weight
    assert pred.decoder.bias is pred.bias
    native.load_state_dict(ref.state_dict(), strict=True)


@pytest.mark.parametrize("seed", [0, 1234])
def test_same_seed_gives_bit_identical_initial_weights(seed):
    """transformers' construction-time init, then its _init_weights (encoder first, then the
    head), then the tie: the same draws from the torch RNG, and the same RNG state after."""
    torch.manual_seed(seed)
    ref = HFWrapped(CFG, VOCAB)
    after_ref = torch.rand(4)
    torch.manual_seed(seed)
    native = BertMaskedLM(CFG, VOCAB)
    assert torch.equal(torch.rand(4), after_ref)
    ref_sd = ref.state_dict()
    for key, value in native.state_dict().items():
        assert torch.equal(value, ref_sd[key]), key
    assert not native.mlm.bert.embeddings.word_embeddings.weight[PAD_ID].any()


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train_dropout"])
def test_same_weights_same_loss_and_gradients(train):
    """The transformers state_dict loaded into the native model: the same loss and gradients
    (tolerances allow for kernel differences; on this CPU they are bit-identical, dropout
    masks included since the RNG is drawn in the same order)."""
    torch.manual_seed(7)
    ref = HFWrapped(CFG, VOCAB)
    torch.manual_seed(8)
    native = BertMaskedLM(CFG, VOCAB)
    native.load_state_dict(ref.state_dict(), strict=True)
    ref.train(train)
    native.train(train)
    ids, labels = _batch()
    torch.manual_seed(5)
    ref_loss = ref(ids, labels)
    ref_loss.backward()
    torch.manual_seed(5)
    loss = native(ids, labels)
    loss.backward()
    assert loss.ndim == 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0.0)
    ref_params = dict(ref.named_parameters())
    for key, param in native.named_parameters():
        torch.testing.assert_close(
            param.grad, ref_params[key].grad, rtol=1e-4, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}"
        )


def test_meta_device_model_has_the_flops_formula():
    """The planner builds the model on ``meta`` (no init work) and reads only the config."""
    with torch.device("meta"):
        model = BertMaskedLM(CFG, VOCAB)
    h, inter, layers, seq, masked = 64, 128, 2, 32, 4.5
    encoder = 2 * layers * (4 * h * h + 2 * h * inter) * seq + layers * 4 * seq * seq * h
    assert model.flops_per_sample(seq, masked) == 3.0 * (encoder + 2 * (h * h + h * VOCAB) * masked)


def _optimizer(lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=lr)


@pytest.mark.parametrize(
    "schedule,hf_name",
    [("linear", "linear"), ("cosine", "cosine"), ("constant", "constant_with_warmup")],
)
def test_schedules_match_transformers_every_step(schedule, hf_name):
    """warm-up 3, total 10, run past the end: the same LR at every step, and a transformers
    scheduler's state_dict (old checkpoints) resumes into ours with the same LRs."""
    ours_opt, ref_opt = _optimizer(), _optimizer()
    ours = build_scheduler(ours_opt, schedule, 3, 10)
    import transformers

    ref = transformers.get_scheduler(hf_name, ref_opt, num_warmup_steps=3, num_training_steps=10)
    for _ in range(13):
        assert ours.get_last_lr() == ref.get_last_lr()
        ours_opt.step()
        ref_opt.step()
        ours.step()
        ref.step()
        if ours.last_epoch == 5:
            resumed_opt = _optimizer()
            resumed = build_scheduler(resumed_opt, schedule, 3, 10)
            resumed_opt.load_state_dict(ref_opt.state_dict())
            resumed.load_state_dict(ref.state_dict())
            assert resumed.state_dict().keys() == ref.state_dict().keys()
    assert resumed.last_epoch == 5
    for _ in range(8):
        resumed_opt.step()
        resumed.step()
    assert resumed.get_last_lr() == ref.get_last_lr()
