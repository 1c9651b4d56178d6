"""Tests of the worker side (kvtier/connectors/worker/)."""
