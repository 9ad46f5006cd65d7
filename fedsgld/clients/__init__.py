"""The site (hospital) side of fedsgld: the site's maths (:mod:`.site`), its policy and
ledger (:mod:`.policy`, :mod:`.site_ledger`), what it admits and charges (:mod:`.guard`), what it releases
(:mod:`.release`) and which code it runs (:mod:`.approval`, standard library only).

Nothing is imported here, so a SuperNode's launcher can check a bundle's approval
(:mod:`fedsgld.clients.approval`) without importing torch.
"""
