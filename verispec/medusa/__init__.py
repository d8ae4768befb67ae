"""Medusa heads: extra heads on the target's last hidden state, head i guessing the token i + 2 places ahead."""
