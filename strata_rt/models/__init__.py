"""Whole models an engine runs beyond the MoE layers."""
