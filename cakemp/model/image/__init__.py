"""Image components (Stable Diffusion), as Cake workers compute them; imported only by devices serving them."""
