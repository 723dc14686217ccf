"""Stored measurements; read them through flashlab.measured."""
