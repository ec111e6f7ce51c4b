"""Stand-in for the overlay target; replaced by upstream's package."""
