"""Megatron-core glue: process groups, model building, forward passes."""
