# XPU (Intel GPU) hardware backend
