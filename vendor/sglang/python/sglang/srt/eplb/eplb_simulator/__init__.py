from . import reader
