"""Small shared pieces every room may import: the error tree and hashing."""
