"""Stages of an encoder-decoder's joined stack, run one after the other in one process: what each
hands the next (the hidden state, T5's position biases, the encoder's output) gives the one-device
loss, and its gradient reaches the first stage's input."""
import copy

import pytest
import torch
import transformers

from megastrategy.pipeline.layer_assignment import assign_layers
from megastrategy.pipeline.seq2seq_layout import seq2seq_layout
from megastrategy.pipeline.seq2seq_stage import cut_seq2seq_stage
from megastrategy.pipeline.stage import MetaStandIn, StageBoundary, Unreachable


class Wrapper(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **batch):
        return self.model(**batch)


def model(kind: str) -> Wrapper:
    torch.manual_seed(0)
    if kind == "t5":
        config = transformers.T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=2, num_heads=2, d_kv=8,
                                       dropout_rate=0.0, relative_attention_num_buckets=8,
                                       decoder_start_token_id=0, pad_token_id=0)
    else:
        config = transformers.BartConfig(vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2,
                                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                         decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0,
                                         decoder_start_token_id=0, pad_token_id=0)
    return Wrapper(transformers.AutoModelForSeq2SeqLM.from_config(config))


def batch():
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    return {"input_ids": torch.randint(3, 64, (2, 7), generator=g) * mask, "attention_mask": mask,
            "labels": torch.randint(3, 64, (2, 5), generator=g)}


def run_stages(full: Wrapper, pp: int):
    """Each stage on its own copy, in order; returns the last stage's loss and the first message."""
    data, message, first = batch(), None, None
    for rank in range(pp):
        module = copy.deepcopy(full)
        layout = seq2seq_layout(module)
        stage = cut_seq2seq_stage(module, layout, assign_layers(layout.num_blocks, pp), rank, pp, 1)
        received = message.detach().requires_grad_() if message is not None else None
        stage.activate(0, received)
        try:
            out = module(**data)
        except StageBoundary as boundary:
            message = boundary.output
            first = first if first is not None else (module, message)
            continue
        finally:
            stage.deactivate()
        out.loss.backward()
        return out, received, first
    raise AssertionError("the last stage did not finish the forward")


@pytest.mark.parametrize("kind", ["t5", "bart"])
@pytest.mark.parametrize("pp", [2, 3, 4])  # 3: uneven, 2 + 1 + 1 blocks
def test_stages_in_a_row_give_the_one_device_loss(kind, pp):
    full = model(kind)
    want = full(**batch())
    out, received, _ = run_stages(full, pp)
    assert torch.allclose(out.loss, want.loss, atol=1e-6), (out.loss, want.loss)
    # after the seam the encoder's output is the received memory, not its stand-ins' zeros
    assert torch.allclose(out.encoder_last_hidden_state, want.encoder_last_hidden_state, atol=1e-6)
    assert received.grad is not None and received.grad.abs().sum() > 0  # the gradient flows back over the cut


def test_the_last_stage_at_pp2_holds_the_decoder_and_stands_in_for_the_encoders_modules():
    module = model("t5")
    layout = seq2seq_layout(module)
    stage = cut_seq2seq_stage(module, layout, assign_layers(4, 2), 1, 2, 1)
    assert len(module.model.encoder.block._modules) == 0 and list(module.model.decoder.block._modules) == ["0", "1"]
    assert isinstance(module.model.encoder.embed_tokens, MetaStandIn)
    assert not isinstance(module.model.encoder.final_layer_norm, MetaStandIn)  # the seam stage runs it
    assert module.model.decoder.embed_tokens.weight is module.model.lm_head.weight
    assert [p is module.model.lm_head.weight for p in stage.tied_parameters] == [True]
    first = model("t5")
    cut_seq2seq_stage(first, seq2seq_layout(first), assign_layers(4, 2), 0, 2, 1)
    assert isinstance(first.model.lm_head, Unreachable) and isinstance(first.model.decoder.embed_tokens, MetaStandIn)
