"""One adapter per agent framework; each imports its framework lazily."""
