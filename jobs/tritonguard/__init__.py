"""A guard in front of Triton's HTTP port: hostile infer requests answer 4xx instead of reaching the server."""
