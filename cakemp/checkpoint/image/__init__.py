"""An image model's components, torch-free: each architecture's row (`archs.py`: its components'
inputs, where their files are, which classes compute them), the file locators (`sd_files.py`,
`flux_files.py`, on the interface of `locator.py`) and SD's standard architectures (`sd_configs.py`).
The components themselves are computed in cakemp/model/image/, on devices only."""
