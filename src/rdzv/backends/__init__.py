"""Rendezvous backends: the contract and its implementations."""
