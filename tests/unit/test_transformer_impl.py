"""Transformer Engine is optional: chosen when importable, a clear error when demanded and missing."""

import pytest

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
