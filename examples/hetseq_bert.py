"""HetSeq's own BERT pre-training model as a user task: plan (or train) the code HetSeq measured.

A port of NVIDIA's older BERT that HetSeq ran (``hetseq/bert_modeling.py``, MIT licence): the
masked-LM head on every position, the Python LayerNorm, HetSeq's attention and GELU; the loss is
the SUM over masked tokens. Plan HetSeq's hardware with it (from the folder that holds
``examples/``)::

    python -m hetseq_hpc plan cluster=hetseq_seed task=custom \
        task.target=examples.hetseq_bert.HetSeqBertTask trainer.global_batch_size=4096 \
        plan.link_gbps=10

What differs from hetseq_hpc's BERT, what is not ported, the data and the options
(``+task.args.<name>``): docs/design/hetseq-comparison.md, "HetSeq's BERT as a user task".
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hetseq_hpc.config.tasks import BertDataConfig, BertModelConfig, BertTaskConfig
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.tasks.bert.mlm_data import IGNORE_INDEX
from hetseq_hpc.tasks.bert.mlm_task import BertTask


def bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """HetSeq's bias + GELU (erf form, its constant 1.41421). HetSeq wraps it in
    ``torch.jit.script`` (deprecated in the torch hetseq_hpc pins), which on a GPU can fuse it into
    fewer kernels; here it runs eagerly, so the plan counts its operations unfused."""
    x = bias + y
    return x * 0.5 * (1.0 + torch.erf(x / 1.41421))


class BertLayerNorm(nn.Module):
    """HetSeq's Python LayerNorm (TF style, epsilon inside the square root): ``(..., H)`` ->
    ``(..., H)``, one kernel per operation, as HetSeq ran it without apex."""

    def __init__(self, hidden_size: int, eps: float = 1e-12):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.variance_epsilon)
        return self.weight * x + self.bias


class LinearGelu(nn.Module):
    """HetSeq's ``LinearActivation(act='gelu')``: a bias-free matmul, then :func:`bias_gelu`."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        bound = 1 / math.sqrt(in_features)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bias_gelu(self.bias, F.linear(x, self.weight, None))


class BertSelfAttention(nn.Module):
    """``(B, T, H)`` and the additive mask ``(B, 1, 1, T)`` -> ``(B, T, H)``."""

    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.head_size = heads, hidden // heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.dropout = nn.Dropout(dropout)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.heads, self.head_size).permute(0, 2, 1, 3)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, v = self._split(self.query(hidden)), self._split(self.value(hidden))
        k = (
            self.key(hidden)
            .view(*hidden.shape[:-1], self.heads, self.head_size)
            .permute(0, 2, 3, 1)
        )
        scores = torch.matmul(q, k) / math.sqrt(self.head_size)
        scores = scores + mask
        probs = self.dropout(F.softmax(scores, dim=-1))
        context = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return context.view(*context.shape[:-2], -1)


class BertLayer(nn.Module):
    """One encoder layer (HetSeq's BertAttention + BertIntermediate + BertOutput):
    ``(B, T, H)`` -> ``(B, T, H)``."""

    def __init__(self, hidden: int, heads: int, intermediate: int, dropout: float):
        super().__init__()
        self.attention = BertSelfAttention(hidden, heads, dropout)
        self.attention_dense = nn.Linear(hidden, hidden)
        self.attention_norm = BertLayerNorm(hidden)
        self.intermediate = LinearGelu(hidden, intermediate)
        self.output_dense = nn.Linear(intermediate, hidden)
        self.output_norm = BertLayerNorm(hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        attended = self.dropout(self.attention_dense(self.attention(hidden, mask)))
        attended = self.attention_norm(attended + hidden)
        out = self.dropout(self.output_dense(self.intermediate(attended)))
        return self.output_norm(out + attended)


class HetSeqBertForPreTraining(nn.Module):
    """HetSeq's ``BertForPreTraining`` without the pooler and next-sentence head.

    ``forward(input_ids, labels)``: ``(B, T)`` int64 ids and labels (``IGNORE_INDEX`` where a
    position is not masked) -> the 0-dim SUM of the masked-LM cross-entropy, computed as HetSeq
    does over the ``(B T, vocab)`` logits of every position.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden: int,
        layers: int,
        heads: int,
        intermediate: int,
        max_positions: int,
        dropout: float,
    ):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden)
        # bert_config.json's max_position_embeddings (512), or more for longer sequences
        self.position_embeddings = nn.Embedding(max(max_positions, 512), hidden)
        self.token_type_embeddings = nn.Embedding(2, hidden)
        self.embedding_norm = BertLayerNorm(hidden)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            BertLayer(hidden, heads, intermediate, dropout) for _ in range(layers)
        )
        self.transform = LinearGelu(hidden, hidden)
        self.transform_norm = BertLayerNorm(hidden)
        self.decoder_bias = nn.Parameter(torch.zeros(vocab_size))
        self.apply(self._init)  # HetSeq's init_bert_weights: normal(0, 0.02), zero biases

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        types = torch.zeros_like(input_ids)  # HetSeq's segment ids; packed text has one segment
        hidden = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(types)
        )
        hidden = self.dropout(self.embedding_norm(hidden))
        # HetSeq's extended attention mask: (1 - mask) * -10000, all zero for unpadded rows
        ones = torch.ones_like(input_ids)
        mask = (1.0 - ones[:, None, None, :].to(hidden.dtype)) * -10000.0
        for layer in self.layers:
            hidden = layer(hidden, mask)
        hidden = self.transform_norm(self.transform(hidden))
        scores = F.linear(hidden, self.word_embeddings.weight) + self.decoder_bias  # tied
        return F.cross_entropy(
            scores.view(-1, scores.shape[-1]).float(),
            labels.view(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )


#: HetSeq's BERT-base (Google's uncased_L-12_H-768_A-12 bert_config.json)
DEFAULTS: Dict[str, Any] = {
    "hidden_size": 768,
    "num_layers": 12,
    "num_heads": 12,
    "intermediate_size": 3072,
    "max_seq_len": 128,
    "vocab_size": 30522,
    "data_vocab_size": 8192,
    "files": [],
    "cache_dir": None,
}


def _whole(name: str, value: Any) -> int:
    """``task.args.<name>`` as an int.

    Raises:
        ConfigError: ``value`` is not a whole number.
    """
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not number.is_integer():
        raise ConfigError(
            f"task.args.{name}={value!r} is not a whole number: set "
            f"+task.args.{name}=<int> (HetSeq's BERT-base: {DEFAULTS[name]})"
        )
    return int(number)


def _dropout(value: Any) -> float:
    """``task.model.dropout`` as a float (its range is checked by hetseq_hpc's BERT config).

    Raises:
        ConfigError: ``value`` is not a number.
    """
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"task.model.dropout={value!r} is not a number: use a value in [0, 1), "
            "e.g. task.model.dropout=0.1 (HetSeq's)"
        ) from None


class HetSeqBertTask(BertTask):
    """Masked-language modelling with :class:`HetSeqBertForPreTraining` on hetseq_hpc's BERT
    data; loss units are masked tokens (exact uneven batches, as hetseq_hpc's BERT).

    Raises:
        ConfigError: an unknown ``task.args`` name, or a value hetseq_hpc's BERT config refuses.
    """

    name = "hetseq_bert"

    def __init__(self, cfg, seed: int):
        args = dict(cfg.args)
        unknown = sorted(set(args) - set(DEFAULTS))
        if unknown:
            raise ConfigError(
                f"task.args.{unknown[0]} is not an option of HetSeqBertTask: use "
                f"one of {', '.join(sorted(DEFAULTS))}"
            )
        self.args = {**DEFAULTS, **args}
        sizes = {
            name: _whole(name, self.args[name])
            for name in (
                "hidden_size",
                "num_layers",
                "num_heads",
                "intermediate_size",
                "max_seq_len",
                "vocab_size",
                "data_vocab_size",
            )
        }
        if sizes["vocab_size"] < sizes["data_vocab_size"]:
            raise ConfigError(
                f"task.args.vocab_size={sizes['vocab_size']} is below the data's "
                f"vocabulary ({sizes['data_vocab_size']}): raise it, or lower "
                "task.args.data_vocab_size"
            )
        files = self.args["files"]
        files = [files] if isinstance(files, str) else list(files or [])
        try:  # hetseq_hpc's BERT config validates the shapes; its messages name task.model.*
            model = BertModelConfig(
                dropout=_dropout(cfg.model.get("dropout", 0.1)),
                **{
                    k: sizes[k]
                    for k in (
                        "hidden_size",
                        "num_layers",
                        "num_heads",
                        "intermediate_size",
                        "max_seq_len",
                    )
                },
            )
            data = BertDataConfig(
                files=files, cache_dir=self.args["cache_dir"], vocab_size=sizes["data_vocab_size"]
            )
        except ConfigError as exc:
            message = str(exc).replace("task.data.vocab_size", "task.args.data_vocab_size")
            raise ConfigError(re.sub(r"task\.model\.(?!dropout)", "task.args.", message)) from None
        super().__init__(BertTaskConfig(model=model, data=data), seed)

    @property
    def data_summary(self) -> Dict[str, Any]:
        """The corpus, the tokenizer's vocabulary (the data's) and the model's (HetSeq's), and
        the split sizes, for the log and ``summary.json``."""
        return {
            "source": self.corpus.name,
            "data_vocab_size": int(self.data.vocab_size),
            "model_vocab_size": int(self.args["vocab_size"]),
            "seq_len": int(self.data.seq_len),
            "train_sequences": self.num_train,
            "val_sequences": self.num_val,
        }

    def build_model(self) -> HetSeqBertForPreTraining:
        """A freshly initialised HetSeq BERT (seed the RNG first)."""
        m = self.cfg.model
        return HetSeqBertForPreTraining(
            int(self.args["vocab_size"]),
            m.hidden_size,
            m.num_layers,
            m.num_heads,
            m.intermediate_size,
            m.max_seq_len,
            m.dropout,
        )

    def flops_per_sample(self, model: nn.Module) -> Optional[float]:
        """None: counted by ``FlopCounterMode`` on a real batch (the head on every position)."""
        return None
