"""Transformer Engine is optional: chosen when importable, a clear error when demanded and missing."""

import pytest
import torch

from mrl.megatron import model


def test_auto_falls_back_to_local_without_te(monkeypatch):
    monkeypatch.setattr(model, "transformer_engine_available", lambda: False)
    assert model.resolve_transformer_impl("auto") is False
    assert model.resolve_transformer_impl("local") is False


def test_auto_picks_te_when_importable(monkeypatch):
    monkeypatch.setattr(model, "transformer_engine_available", lambda: True)
    assert model.resolve_transformer_impl("auto") is True
    assert model.resolve_transformer_impl("local") is False


def test_demanding_te_without_it_fails_clearly(monkeypatch):
    monkeypatch.setattr(model, "transformer_engine_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"Transformer Engine is not installed.*pip install -e '\.\[gpu\]'"):
        model.resolve_transformer_impl("transformer_engine")


def test_unknown_impl():
    with pytest.raises(ValueError, match="not one of"):
        model.resolve_transformer_impl("apex")


@pytest.mark.parametrize("vocab, tp, padded", [(1000, 1, 1024), (1000, 2, 1024), (1000, 4, 1024), (1025, 2, 1280), (256, 2, 256)])
def test_vocab_padding(vocab, tp, padded):
    assert model.padded_vocab_size(vocab, tp) == padded


@pytest.mark.parametrize("fp8, fmt, recipe", [("delayed", "hybrid", "delayed"), ("tensorwise", "hybrid", "tensorwise"),
                                              ("blockwise", "e4m3", "blockwise"), ("mxfp8", "e4m3", "mxfp8")])
def test_fp8_maps_to_megatron_fields(fp8, fmt, recipe):
    from megatron.core.transformer import TransformerConfig

    options = model.fp8_options(fp8)
    assert (options["fp8"], options["fp8_recipe"]) == (fmt, recipe)
    fields = TransformerConfig.__dataclass_fields__
    assert set(options) <= set(fields)  # every key is a TransformerConfig field of this megatron-core
    # the values are among the fields' Literal choices (Optional[Literal[...]], compared as text)
    assert f"'{fmt}'" in str(fields["fp8"].type) and f"'{recipe}'" in str(fields["fp8_recipe"].type)


def test_fp8_off_adds_nothing():
    assert model.fp8_options(None) == {}
    with pytest.raises(ValueError, match="model.fp8 'fp4' is not one of delayed, tensorwise, blockwise, mxfp8"):
        model.fp8_options("fp4")


def test_fp8_refused_without_te_or_cuda():
    model.check_fp8(None, use_te=False, cuda=False)
    with pytest.raises(RuntimeError, match="model.fp8 'blockwise' needs Transformer Engine's layers.*model.fp8: null"):
        model.check_fp8("blockwise", use_te=False, cuda=True)
    with pytest.raises(RuntimeError, match="model.fp8 'delayed' needs a CUDA GPU"):
        model.check_fp8("delayed", use_te=True, cuda=False)
    model.check_fp8("delayed", use_te=True, cuda=True)


def test_fp8_pads_sequences_for_transformer_engines_gemms():
    from mrl.layout import ParallelLayout

    def built(tp: int, fp8):
        return model.BuiltModel([], None, ParallelLayout(tp=tp), 0, True, fp8=fp8)

    assert built(2, None).sequence_multiple == 2  # sequence parallelism only
    assert built(2, "blockwise").sequence_multiple == 32 and built(4, "delayed").sequence_multiple == 64
    assert built(1, "mxfp8").sequence_multiple == 32
    from mrl.megatron.policy import micro_batches

    batch = {"tokens": torch.ones(2, 21, dtype=torch.long), "response_mask": torch.ones(2, 20)}
    (micro,) = micro_batches(batch, built(2, "tensorwise").sequence_multiple, 2)
    assert micro["tokens"].shape[1] == 32  # 20 positions padded to a multiple of TP·16
