"""fabric package."""
