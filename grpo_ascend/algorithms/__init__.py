"""Advantage estimators and policy/value losses, each behind a small registry."""
