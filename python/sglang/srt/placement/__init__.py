"""Where each scheduler rank runs: one ProcessPlacement, resolved on its host."""
