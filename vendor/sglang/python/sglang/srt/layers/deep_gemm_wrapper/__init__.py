from .entrypoint import *
