"""Expert-pack build, inspection, and validation utilities."""
