"""Tests of the scheduler side (kvtier/connectors/scheduler/)."""
